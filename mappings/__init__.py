"""Declarative tables: parameter names and config keys of each framework."""
