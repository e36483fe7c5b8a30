"""torchvision's ResNet-18 (BatchNorm) in Flower's Message API, switched to flwr_pfl algorithms."""
