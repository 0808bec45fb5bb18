"""The tests' import path: the model zoo they train (bench/llama_zoo) is not part of the strata
package, so it comes from the checkout, as in bench/ and examples/."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
