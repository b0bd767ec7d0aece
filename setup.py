"""Packaging for grpo-lab: everything is read from settings.ini (nbdev 2 layout).

Installing needs only setuptools; nbdev is a development tool and is never required
by `pip install grpo-lab`.
"""
from configparser import ConfigParser
from pathlib import Path

import setuptools

here = Path(__file__).parent
cfg = ConfigParser(delimiters=["="])
cfg.read(here / "settings.ini", encoding="utf-8")
cfg = cfg["DEFAULT"]

licenses = {"apache2": ("Apache Software License 2.0", "OSI Approved :: Apache Software License")}
lic_name, lic_classifier = licenses[cfg["license"]]
statuses = ["1 - Planning", "2 - Pre-Alpha", "3 - Alpha", "4 - Beta", "5 - Production/Stable"]
min_python = cfg["min_python"]
py_versions = ["3.10", "3.11", "3.12", "3.13"]

requirements = cfg.get("requirements", "").split()
dev_requirements = cfg.get("dev_requirements", "").split()
console_scripts = cfg.get("console_scripts", "").split()
readme = here / "README.md"

setuptools.setup(
    name=cfg["lib_name"],
    version=cfg["version"],
    description=cfg["description"],
    long_description=readme.read_text(encoding="utf-8") if readme.exists() else cfg["description"],
    long_description_content_type="text/markdown",
    author=cfg["author"],
    author_email=cfg["author_email"],
    license=lic_name,
    url=cfg["git_url"],
    keywords=cfg["keywords"].split(),
    classifiers=[
        "Development Status :: " + statuses[int(cfg["status"])],
        "Intended Audience :: " + cfg["audience"].title(),
        "License :: " + lic_classifier,
        "Natural Language :: " + cfg["language"].title(),
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ] + ["Programming Language :: Python :: " + v for v in py_versions[py_versions.index(min_python):]],
    packages=setuptools.find_packages(include=["grpo_lab", "grpo_lab.*"]),
    include_package_data=True,
    package_data={"grpo_lab": ["assets/**/*", "assets/*/*", "assets/*/*/*", "py.typed", "*.pyi",
                               "configs/*.yaml"]},   # configs: the run files
    install_requires=requirements,
    extras_require={"dev": dev_requirements, "gguf": cfg.get("gguf_requirements", "").split(),
                    "bench": cfg.get("bench_requirements", "").split(),
                    "vllm": cfg.get("vllm_requirements", "").split(),
                    "docs": cfg.get("docs_requirements", "").split()},
    python_requires=">=" + min_python,
    entry_points={"console_scripts": console_scripts, "nbdev": [f"{cfg['lib_path']}={cfg['lib_path']}._modidx:d"]},
    zip_safe=False,
)
