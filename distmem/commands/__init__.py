"""CLI subcommands; each module exposes add_arguments(parser) and run(args) -> int."""
__all__ = []
