"""Neural-network building blocks written with flowjit ops: activations, normalization, losses,
convolution and pooling, attention, embeddings, dropout and initializers. Everything works under
`fj.jit` and `fj.grad`, and eagerly on numpy arrays.

Layouts and definitions follow PyTorch (images NCHW, convolution weights OIHW, losses with
`reduction=`), except that class scores are on the last axis, as in JAX. The functions live by family
in `flowjit/nn/{activations,normalization,losses,conv,layers,initialization}.py`; this module is the
public namespace.
"""

from flowjit.nn import composites  # noqa: E402,F401  (registers nn's composites for the backends)
from flowjit.nn.activations import (  # noqa: F401 (the public namespace)
    celu,
    cosine_similarity,
    elu,
    gelu,
    glu,
    hard_sigmoid,
    hard_silu,
    hard_swish,
    hard_tanh,
    leaky_relu,
    log_sigmoid,
    log_softmax,
    logsumexp,
    mish,
    normalize,
    relu,
    relu6,
    selu,
    sigmoid,
    silu,
    softmax,
    softplus,
    softsign,
    swish,
    tanh,
)
from flowjit.nn.conv import (  # noqa: F401 (the public namespace)
    adaptive_avg_pool2d,
    avg_pool2d,
    conv1d,
    conv2d,
    conv_transpose2d,
    global_avg_pool2d,
    max_pool2d,
)
from flowjit.nn.initialization import initializers  # noqa: F401 (the public namespace)
from flowjit.nn.layers import (  # noqa: F401 (the public namespace)
    dropout,
    embedding,
    linear,
    multi_head_attention,
    scaled_dot_product_attention,
)
from flowjit.nn.losses import (  # noqa: F401 (the public namespace)
    accuracy,
    binary_cross_entropy,
    binary_cross_entropy_with_logits,
    cross_entropy,
    huber_loss,
    kl_div,
    l1_loss,
    mse_loss,
    nll_loss,
    one_hot,
    smooth_l1_loss,
)
from flowjit.nn.normalization import (  # noqa: F401 (the public namespace)
    batch_norm,
    batch_norm_train,
    group_norm,
    instance_norm,
    layer_norm,
    rms_norm,
)
