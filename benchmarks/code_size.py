"""Code size of the runtime package against the size limits: `tandem.testing.code_size`
(shared with tests/test_code_size.py), run from here as every benchmark is.

    python benchmarks/code_size.py [--root src/tandem] [--files models/deepseek.py ...] [--check]
"""

from tandem.testing.code_size import main

if __name__ == "__main__":
    main()
