"""`attnkit demo` and `attnkit walkthrough`."""

from __future__ import annotations
