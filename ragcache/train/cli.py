"""`ragcache train ...` commands."""

import typer

train_app = typer.Typer(help="Fine-tune models for EFIM infilling (fragment tokenization).", no_args_is_help=True)
