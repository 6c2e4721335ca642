"""The `coordinator` subcommands other than the daemon (`start`): plan, demo, report, status
and the plots they draw (docs/architecture.md, "Layout"). Library code never imports these;
`coordinator/cli.py`, the entry point, does."""
