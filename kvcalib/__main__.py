"""`python -m kvcalib` is the `kvcalib` command (what `torchrun -m kvcalib ...` runs in each process)."""

from .cli import main

if __name__ == "__main__":
    main()
