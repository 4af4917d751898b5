from blazar.cli.main import entrypoint

entrypoint()
