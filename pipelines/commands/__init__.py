"""The `shipyard` subcommands, one module per command (or per group that shares its
options), the layout of DVC's `dvc/commands/`: each module has `add_parser(subparsers)`,
which adds its parser (arguments, a one-line `help`, a `description`), and `run(args)`,
which returns the exit status. `pipelines/cli.py` assembles the parsers in `COMMANDS`'
order, adds the global options and turns a ShipyardError into its exit code.

A command module imports at its top only the standard library and `_common`: the parser is
built for every command, and `shipyard run-stage` must load nothing of ours that the stage
does not declare (tests/pipelines/test_derived_deps.py). Commands never import each other
(an import-linter contract); what several share is in `_common`.
"""
