"""The zoo tests reuse the zoo_dir fixture that other packages' tests get from the zoo.testing plugin."""
from zoo.testing import zoo_dir  # noqa: F401  (re-exported as a fixture for tests/zoo)
