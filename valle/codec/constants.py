"""The audio format every codec here produces: EnCodec 24 kHz at 6 kbps, which the offline
mel-rvq codec copies so that the models, the collation and the trainer never change with
the codec. Pure numbers: importing this loads nothing."""

SAMPLE_RATE = 24_000
HOP_LENGTH = 320  # samples per frame
FRAME_RATE = SAMPLE_RATE // HOP_LENGTH  # 75 frames/s
FRAME_SHIFT = HOP_LENGTH / SAMPLE_RATE  # seconds per frame (lhotse's word for it)
NUM_QUANTIZERS = 8  # codebooks per frame (EnCodec at 6 kbps)
CODEBOOK_SIZE = 1024  # codes per codebook
NUM_AUDIO_TOKENS = CODEBOOK_SIZE  # also the padding id of stored audio codes (one past the last code)
