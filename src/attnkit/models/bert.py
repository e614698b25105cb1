"""BERT-family encoders and sentence embeddings: the public names of the files that
implement them, in one place (as before they were split).

- `attnkit.models.bert_model`: `BertModel`, its forward, `load_bert`;
- `attnkit.models.sentence`: `SentenceEncoder` (alias `SentenceTransformer`);
- `attnkit.models.bert_config`, `bert_tokenizer`, `bert_checkpoint`: the config, the
  tokenizer and the checkpoint names.
"""

from __future__ import annotations

from attnkit.models.bert_checkpoint import BERT_IGNORED, BERT_NAME_TABLE, bert_shapes, check_bert_header
from attnkit.models.bert_config import BertConfig
from attnkit.models.bert_model import BertEmbeddings, BertModel, BertOutput, gelu_inplace, load_bert
from attnkit.models.bert_tokenizer import BertTokenizer, check_texts
from attnkit.models.sentence import SentenceEncoder, SentenceTransformer

__all__ = [
    "BERT_IGNORED",
    "BERT_NAME_TABLE",
    "BertConfig",
    "BertEmbeddings",
    "BertModel",
    "BertOutput",
    "BertTokenizer",
    "SentenceEncoder",
    "SentenceTransformer",
    "bert_shapes",
    "check_bert_header",
    "check_texts",
    "gelu_inplace",
    "load_bert",
]
