"""`python -m ragcache`: the `ragcache` command where its console script is not on PATH."""

from .cli import main

main()
