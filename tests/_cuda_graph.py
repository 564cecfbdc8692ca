"""A GPU tests' helper: one layer fwd+bwd captured in a CUDA graph on a side stream."""

import torch


def capture_fwd_bwd(layer, x, lens, dy):
    """Capture ``layer(x, lens).backward(dy)`` (gradients cleared first, so the graph writes them
    fresh); returns ``(graph, y)``: replaying the graph recomputes y, x.grad and the weight's grad
    from whatever x, lens and dy hold then."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        layer.weight.grad = None
        x.grad = None
        with torch.cuda.graph(graph):
            y = layer(x, lens)
            y.backward(dy)
    torch.cuda.current_stream().wait_stream(stream)
    return graph, y


def replay_against_eager(layer, x, lens, dy, graph, y, new_lens, switch):
    """Write ``new_lens`` into the captured routing and replay ``graph``; then run the same fwd+bwd
    eagerly with ``switch(False)`` (the path under test off; ``switch`` returns the previous
    setting, restored after). Returns ``(replayed, eager)``, each ``(y, dx, dW)``."""
    lens.copy_(new_lens)
    graph.replay()
    torch.cuda.synchronize()
    replayed = (y.detach().clone(), x.grad.clone(), layer.weight.grad.clone())
    previous = switch(False)
    try:
        layer.weight.grad = None
        x.grad = None
        y_eager = layer(x, lens)
        y_eager.backward(dy)
        torch.cuda.synchronize()
    finally:
        switch(previous)
    return replayed, (y_eager.detach(), x.grad, layer.weight.grad)
