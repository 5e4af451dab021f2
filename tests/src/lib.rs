//! Shared helpers for the end-to-end tests in this package's `tests/` folder.
