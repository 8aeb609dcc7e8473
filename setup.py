"""The packages, found rather than listed: every package under each folder of setup.cfg's package_dir (nanovllm_tp,
and the repository's top-level scheduler/, workers/ and launch/, which install under nanovllm_tp, so that nothing
installs a generic top-level name such as `scheduler`). setuptools' `packages = find:` cannot follow that mapping;
everything else (metadata, dependencies, package data, the command) is in setup.cfg."""
import configparser

from setuptools import find_packages, setup


def package_dir(path: str = "setup.cfg") -> dict[str, str]:
    cfg = configparser.ConfigParser()
    cfg.read(path)
    pairs = (line.split("=") for line in cfg["options"]["package_dir"].strip().splitlines())
    return {name.strip(): folder.strip() for name, folder in pairs}


def packages(dirs: dict[str, str]) -> list[str]:
    return sorted({pkg for name, folder in dirs.items() for pkg in [name, *(f"{name}.{sub}"
                                                                             for sub in find_packages(folder))]})


if __name__ == "__main__":
    setup(packages=packages(package_dir()))
