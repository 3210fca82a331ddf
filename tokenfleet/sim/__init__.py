"""Discrete-event simulator: drives the shipped policies against engine models."""
