"""Conversations and images for the task-encoder tests (test_data_task_encoder, test_packing,
test_transformer_impl): messages in the stored conversation format, with their image counts."""

from PIL import Image

from megatron_vlm.data.conversation import split_placeholders, vqa_messages
from megatron_vlm.data.synthetic import image_array


def pil(seed, size=(45, 30)):
    return Image.fromarray(image_array(size, seed))


def user(text):
    return {"role": "user", "content": split_placeholders(text)}


def asst(text):
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


CONVERSATIONS = {
    "vqa": (vqa_messages("what colour is the shape ?", "red"), 1),
    "multi_turn": ([user("<image>\nwhat shape is it ?"), asst("a square"), user("where is it ?"),
                    asst("top left corner"), user("how many ?"), asst("one")], 1),
    "text_only": ([{"role": "system", "content": [{"type": "text", "text": "answer in one word"}]},
                   user("say yes please"), asst("yes")], 0),
    "two_images": ([user("<image>\n<image>\nwhich is red ?"), asst("the first one")], 2),
}
