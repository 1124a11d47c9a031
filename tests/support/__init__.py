"""Helpers shared by the tests (cases, the float64 reference, tolerances, kernel calls, guard pages,
the fuzzer, the family sweep, ...). ``tests/conftest.py`` puts tests/ on ``sys.path``, so tests
import them as ``from support.cases import cu_of``; scripts run from the command line
(``python tests/support/fuzz.py``) put tests/ on their path themselves."""
