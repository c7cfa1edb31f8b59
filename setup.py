"""Packages for setuptools (metadata is in pyproject.toml).

``configs/`` stays at the top of the source tree, where users look for it, and the wheel
carries it as ``videotrain/configs``, so a non-editable install has the Hydra configs too
(``videotrain.config.build`` finds them in either place).
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["videotrain", "videotrain.*"]), "videotrain.configs"],
    package_dir={"videotrain.configs": "configs"},
    package_data={"videotrain.configs": ["*.yaml", "**/*.yaml"]},
)
