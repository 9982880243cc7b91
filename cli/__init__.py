"""The `fedserve` command line (cli/main.py), above every other package."""
