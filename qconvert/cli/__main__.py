"""``python -m qconvert.cli``."""

from . import main

if __name__ == "__main__":
    main()
