"""Helpers shared by test modules of several packages; a test module imports these, never another test module."""
