"""`python -m benchmarks.results docs/results/NAME.json [--output PAGE]`: render a results page from its JSON."""

from benchmarks.results.pages import main

if __name__ == "__main__":
    main()
