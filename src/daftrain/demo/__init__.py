"""The demo behind ``daftrain demo``: ResNet-18 on Fashion-MNIST, plain PyTorch against daftrain. Not API.

``demo.run`` holds it; this package imports nothing, so that ``python -m daftrain.demo.run`` (each
method's fresh process) does not find the module imported before it runs.
"""
