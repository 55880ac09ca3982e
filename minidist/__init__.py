"""minidist."""
