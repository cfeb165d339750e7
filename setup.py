"""Packaging for megatron (core library and training application)."""

from setuptools import find_packages, setup

setup(
    name="megatron-open",
    version="0.1.0",
    description="A from-scratch, Megatron-LM compatible framework for large transformer training.",
    packages=find_packages(include=["megatron", "megatron.*"]),
    package_data={"megatron.training": ["megatron_flags.tsv"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.6", "numpy>=1.26", "packaging>=20"],
    extras_require={
        # Optional GPU accelerators; imported lazily, never needed on CPU.
        "te": ["transformer-engine[pytorch]"],
        "tokenizers": ["tokenizers", "sentencepiece", "tiktoken", "nltk"],
        "logging": ["tensorboard", "wandb"],
    },
)
