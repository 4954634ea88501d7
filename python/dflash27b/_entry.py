"""The `dflash27b` command: the CLI (cli.py), with a Ctrl-C during its first fraction of a second, while
numpy, cffi and the library load, ending as a Ctrl-C does later ("Aborted!", status 130) instead of with a
traceback of the import it interrupted."""
import sys


def main() -> None:
    try:
        from .cli import main as cli
    except KeyboardInterrupt:
        print("\nAborted!", file=sys.stderr)
        sys.exit(130)
    cli()
