"""The CPU image's tests (`make test-images`, which `make test` runs): the image named by
PDSERVE_TEST_IMAGE as containers on a Docker network of their own. Without that variable
(the main suite's `pytest tests`) nothing here is collected: `make test-images` builds the image
first and sets it."""

from __future__ import annotations

import os

collect_ignore_glob = [] if os.environ.get("PDSERVE_TEST_IMAGE") else ["test_*.py"]
