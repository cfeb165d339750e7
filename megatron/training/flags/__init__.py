"""One record per command-line flag (see ``record.py``), grouped like Megatron's ``--help``.

``model.py``, ``training.py``, ``checkpointing.py``, ``data.py`` and ``logging.py`` hold
the records; ``derive.py`` the named functions that compute config fields from
flags; ``reasons.py`` why no-op flags change nothing; ``registry.py`` indexes the
records and generates the parser's statuses and the flag -> config mapping.
Implementing a flag is editing its record and the code that uses it.
"""
