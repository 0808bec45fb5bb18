#!/usr/bin/env bash
# Prints the path of the Python virtual environment the scripts use: $STRATA_VENV if set, else
# ~/.cache/strata-venv (outside the repository, so a clean clone reuses it).
echo "${STRATA_VENV:-${HOME:-/root}/.cache/strata-venv}"
