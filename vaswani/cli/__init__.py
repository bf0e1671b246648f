"""The `vaswani` command line: `main.py` holds the command table and `main()`, and each subcommand is a module here.

`main` is not imported into this package, so that `vaswani.cli.main` names one thing, the module.
"""
