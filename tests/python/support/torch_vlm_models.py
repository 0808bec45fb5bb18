"""Tiny vision-language models and their image+text batches for test_torch_vlm.py.

Each family is built from config objects on the CPU with random weights (nothing is
downloaded) and gets batches built without a processor, as the model code reads them: the
image placeholder tokens in input_ids (the count the vision tower produces per image, between
the family's begin/end-of-image tokens where it has them), pixel tensors of the layout its
vision tower takes (Qwen's flattened patches with image_grid_thw and mm_token_type_ids for the
3-D multimodal rope; Gemma 3's and LLaVA's images with token_type_ids where Gemma 3 wants
them), and labels with the prompt and the image tokens masked (-100), as supervised
fine-tuning masks them. Text ids are drawn from 10 up, above every special token used.
Models and batches are on torch_parity_models.DEVICE."""
import torch
import transformers

from torch_parity_models import DEVICE  # the CPU, or STRATA_PARITY_DEVICE's GPU

VOCAB = 128
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
IMAGE, VIDEO, BEGIN, END = 3, 4, 5, 6  # the special tokens' ids
FAMILIES = ("qwen2_5_vl", "qwen3_vl", "gemma3", "llava", "smolvlm", "mistral3")


def _qwen_vision(**extra):
    """A Qwen vision tower over 4 x 4-pixel patches, 2 frames per temporal patch, merged 2 x 2
    into one token: an image of 4 x 4 patches is 4 tokens."""
    return dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, **extra)


def _build_config(family, vision_hidden=32, vision_depth=2):
    if family == "qwen2_5_vl":
        text = dict(TEXT, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                           "rope_theta": 10000.0})
        vision = _qwen_vision(window_size=16, fullatt_block_indexes=[1])
        vision.update(hidden_size=vision_hidden, intermediate_size=2 * vision_hidden,
                      depth=vision_depth)
        cfg = transformers.Qwen2_5_VLConfig(
            text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
            vision_start_token_id=BEGIN, vision_end_token_id=END)
    elif family == "qwen3_vl":
        text = dict(TEXT, head_dim=16, rope_parameters={
            "rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True,
            "rope_theta": 10000.0})
        vision = _qwen_vision(num_position_embeddings=16, deepstack_visual_indexes=[0])
        cfg = transformers.Qwen3VLConfig(
            text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
            vision_start_token_id=BEGIN, vision_end_token_id=END)
    elif family == "gemma3":
        # SigLIP over 16 x 16 images of 4 x 4 patches, pooled to 2 x 2 = 4 tokens an image.
        text = dict(TEXT, head_dim=16, sliding_window=8, query_pre_attn_scalar=16)
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, image_size=16, patch_size=4, vision_use_head=False)
        cfg = transformers.Gemma3Config(
            text_config=text, vision_config=vision, mm_tokens_per_image=4,
            boi_token_index=BEGIN, eoi_token_index=END, image_token_index=IMAGE)
    elif family == "llava":
        # CLIP over 16 x 16 images of 4 x 4 patches: 16 tokens an image (the class token
        # dropped, vision_feature_select_strategy "default").
        text = dict(TEXT, model_type="llama")
        vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                      num_hidden_layers=3, num_attention_heads=2, image_size=16, patch_size=4,
                      projection_dim=32)
        cfg = transformers.LlavaConfig(text_config=text, vision_config=vision,
                                       image_token_index=IMAGE, image_seq_length=16)
    elif family == "smolvlm":
        # SigLIP-like over 16 x 16 images of 4 x 4 patches, pixel-shuffled by 2: 4 tokens.
        text = dict(TEXT, model_type="llama")
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, image_size=16, patch_size=4)
        cfg = transformers.SmolVLMConfig(text_config=text, vision_config=vision,
                                         image_token_id=IMAGE, scale_factor=2)
    elif family == "mistral3":
        # Pixtral (2-D rotary) over 16 x 16 images of 4 x 4 patches, merged 2 x 2: 4 tokens.
        text = dict(TEXT, model_type="mistral", head_dim=16)
        vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=2, head_dim=16, image_size=16,
                      patch_size=4)
        cfg = transformers.Mistral3Config(text_config=text, vision_config=vision,
                                          image_token_index=IMAGE, spatial_merge_size=2)
    else:
        raise ValueError(family)
    cfg._attn_implementation = "eager"
    return cfg


# The families whose projector's _init_weights starts at zero (Gemma 3's
# mm_input_projection_weight): no grad reaches the vision tower at the first step.
ZERO_PROJECTOR = ("gemma3",)

MODEL_CLASSES = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                 "qwen3_vl": "Qwen3VLForConditionalGeneration",
                 "gemma3": "Gemma3ForConditionalGeneration",
                 "llava": "LlavaForConditionalGeneration",
                 "smolvlm": "SmolVLMForConditionalGeneration",
                 "mistral3": "Mistral3ForConditionalGeneration"}


def build(family, seed=0, **sizes):
    """A freshly initialized model, the same for the same (family, seed, sizes), in train
    mode."""
    torch.manual_seed(seed)
    model = getattr(transformers, MODEL_CLASSES[family])(_build_config(family, **sizes))
    model.train()
    return model.to(DEVICE)


def family_of(model):
    """The family name of a model build() made."""
    return next(f for f, name in MODEL_CLASSES.items() if type(model).__name__ == name)


def vision_tower(model):
    """The model's vision tower (transformers 5 names it visual, vision_tower or
    vision_model)."""
    inner = model.model
    for name in ("visual", "vision_tower", "vision_model"):
        if hasattr(inner, name):
            return getattr(inner, name)
    raise AttributeError("no vision tower in %s" % type(model).__name__)


def image_batch(family, batch=2, seed=1):
    """One image per row, placed after two text tokens; labels only on the text after it."""
    g = torch.Generator().manual_seed(seed)
    tokens = 16 if family == "llava" else 4  # each image's placeholder tokens
    bracketed = family in ("qwen2_5_vl", "qwen3_vl", "gemma3")  # between begin/end tokens
    first = 2 + bracketed  # the first image token's position
    seq = first + tokens + bracketed + 16
    ids = torch.randint(10, VOCAB, (batch, seq), generator=g)
    if bracketed:
        ids[:, first - 1], ids[:, first + tokens] = BEGIN, END
    ids[:, first:first + tokens] = IMAGE
    labels = ids.clone()
    labels[:, :first + tokens + bracketed] = -100
    out = dict(input_ids=ids, labels=labels)
    if family.startswith("qwen"):
        # Flattened patches: (patches, channels x temporal patch x patch x patch), each image
        # 1 x 4 x 4 patches (t, h, w); mm_token_type_ids marks the image tokens (1) for the
        # multimodal rope's 3-D positions.
        out["pixel_values"] = torch.randn(batch * 16, 3 * 2 * 4 * 4, generator=g)
        out["image_grid_thw"] = torch.tensor([[1, 4, 4]] * batch)
        out["mm_token_type_ids"] = (ids == IMAGE).long()
    elif family == "smolvlm":  # (batch, images per row, channels, height, width)
        out["pixel_values"] = torch.randn(batch, 1, 3, 16, 16, generator=g)
    else:
        out["pixel_values"] = torch.randn(batch, 3, 16, 16, generator=g)
        if family == "mistral3":  # each image's height and width in pixels
            out["image_sizes"] = torch.tensor([[16, 16]] * batch)
        if family == "gemma3":  # image tokens attend to each other both ways in training
            out["token_type_ids"] = (ids == IMAGE).long()
    return {k: v.to(DEVICE) for k, v in out.items()}


def text_batch(batch=2, seq=20, seed=2):
    """Text only (a VLM's batch without images): labels are the inputs."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, VOCAB, (batch, seq), generator=g).to(DEVICE)
    return dict(input_ids=ids, labels=ids.clone())


def batches(family, steps):
    """Image+text and text-only batches in turn, starting with images."""
    image, text = image_batch(family), text_batch()
    return [image if i % 2 == 0 else text for i in range(steps)]


def train(model, opt, data):
    """The loop both sides run: per batch forward with labels, backward, step, zero_grad.
    Returns the losses."""
    losses = []
    for batch in data:
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
