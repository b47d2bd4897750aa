"""The `dflash` command: one module per subcommand, each a thin layer over one package's domain calls.

It sits above every package (the services and `training`), so no service imports another, or
training, for the sake of a command. `dflash_cli.main:main` is the console script.
"""
