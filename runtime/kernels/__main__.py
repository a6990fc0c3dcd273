"""`python -m staticlm.runtime.kernels`: builds the kernels library into this package (build.py), e.g. after a C
compiler was installed."""
import sys

from staticlm.runtime.kernels.build import main

sys.exit(main())
