"""`python -m demo`: the whole pipeline on a tiny model (see demo/pipeline.py)."""

from demo.pipeline import main

if __name__ == "__main__":
    main()
