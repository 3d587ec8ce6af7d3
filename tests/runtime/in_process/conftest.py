"""The MLServer runtime imports mlserver, whose protobufs clash with tritonclient's (the serve
stage imports those): in one interpreter, whichever comes second fails to import. These
in-process tests of the runtime therefore run in a pytest process of their own
(`make test` starts it after the main suite, with SHIPYARD_RUNTIME_TESTS=1); the main
session skips collecting them."""

import os

if not os.environ.get("SHIPYARD_RUNTIME_TESTS"):
    collect_ignore_glob = ["test_*.py"]
