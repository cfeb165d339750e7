"""A FAKE ``transformer_engine`` for CPU tests: only the API surface our adapter uses, in plain torch.

Put ``tests/fakes`` on ``sys.path`` only inside a test (``tests/te_fake.py``). Its signatures are
checked against the real Transformer Engine's sources by ``test_te_oracle.py``.
"""
