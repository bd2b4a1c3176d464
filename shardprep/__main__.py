"""``python -m shardprep`` runs the CLI."""

from shardprep.cli import main

main()
