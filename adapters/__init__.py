"""packlora subpackage."""
