"""What is trained: the model, its optimizer, and the data.

model.py   the CNN (its convolutions channels_last), parameter vectors whatever the layout
optim.py   Adam through torch's fused kernel, and the one-cycle learning rate
data.py    MNIST as four tensors, and each rank's share of every step
mnist.py   the four MNIST files in data/, decompressed once and checked
training.py  what the epoch loop holds from epoch to epoch (Trainer, Steps), the optimizer, the batches
"""
