"""posttrain.cli: the `posttrain` command and its subcommands (one module per subcommand)."""
