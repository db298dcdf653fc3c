"""The command line: the `zdsl` subcommands that drive a model (run, chat, model, bench, profile, tune, eval)."""
