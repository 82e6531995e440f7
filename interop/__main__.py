"""`python -m interop` is the `interop` command."""
from .cli.main import main

main()
