"""One package per API dialect: pure translation functions and thin routes."""
