//! Tests for the SFT and preference datasets.
