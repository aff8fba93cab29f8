"""setuptools' build folder outside the checkout: by default every `pip install .` (and `pip wheel .`) leaves a
`build/` folder in it. Everything else about the package is in pyproject.toml."""

import atexit
import shutil
import tempfile

from setuptools import setup
from setuptools.command.build import build


class BuildOutsideTheCheckout(build):
    """`build_base` (build/lib, build/bdist.*) in a temporary folder removed when the build process exits."""

    def initialize_options(self) -> None:
        super().initialize_options()
        self.build_base = tempfile.mkdtemp(prefix="open-instruct-build-")
        atexit.register(shutil.rmtree, self.build_base, ignore_errors=True)


setup(cmdclass={"build": BuildOutsideTheCheckout})
