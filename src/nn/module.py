"""Module: a plain container of parameters and sub-modules with Hugging Face-style names."""
import contextlib

from ..tensor import Tensor


class Module:
    """Attributes that are Tensors are parameters; attributes that are Modules (or lists of them)
    are children. Names follow attribute paths, e.g. `model.layers.0.self_attn.q_proj`."""

    training = True

    def named_children(self):
        for name, value in vars(self).items():
            if isinstance(value, Module):
                yield name, value
            elif isinstance(value, (list, tuple)) and value and isinstance(value[0], Module):
                for i, m in enumerate(value):
                    yield f"{name}.{i}", m

    def named_modules(self, prefix=""):
        yield prefix, self
        for name, child in self.named_children():
            yield from child.named_modules(f"{prefix}.{name}" if prefix else name)

    def named_parameters(self, prefix=""):
        for mod_name, mod in self.named_modules(prefix):
            for name, value in vars(mod).items():
                if isinstance(value, Tensor):
                    yield (f"{mod_name}.{name}" if mod_name else name), value

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def trainable(self):
        """(name, tensor) of every parameter that requires grad."""
        return [(n, p) for n, p in self.named_parameters() if p.requires_grad]

    def get_module(self, path):
        mod = self
        for part in path.split("."):
            mod = mod[int(part)] if isinstance(mod, (list, tuple)) else getattr(mod, part)
        return mod

    def set_module(self, path, new):
        parent_path, _, last = path.rpartition(".")
        parent = self.get_module(parent_path) if parent_path else self
        if isinstance(parent, (list, tuple)):
            parent[int(last)] = new
        else:
            setattr(parent, last, new)

    def train(self, mode=True):
        for _, m in self.named_modules():
            m.training = mode
        return self

    def eval(self):
        return self.train(False)

    @contextlib.contextmanager
    def evaluating(self):
        """Eval mode (no dropout, no draws from the device generator) inside the block."""
        was_training = self.training
        self.eval()
        try:
            yield self
        finally:
            self.train(was_training)

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)
