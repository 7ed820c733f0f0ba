"""``python -m client.bench``: benchmark the `llm` model over gRPC streaming (see client.bench.cli)."""

import sys

from client.bench.cli import main

sys.exit(main())
