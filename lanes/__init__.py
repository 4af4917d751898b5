"""One module per engine kind: how to build, spawn, probe and talk to it. No trio state here."""
