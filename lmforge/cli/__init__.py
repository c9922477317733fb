"""Command-line interface: thin argparse layers over the library modules."""
