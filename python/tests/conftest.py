"""Puts python/ (the in-place build of pcpkv_torch) and this folder (helpers.py) on sys.path. Each test
module itself skips, with the reason, when torch or the built extension is missing (helpers.need_package)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
