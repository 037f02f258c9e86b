"""One-off acceptance experiments of past issues: run from the repository root as
`python -m experiments.<name>`. Not installed with pdserve."""
