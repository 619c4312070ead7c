from dflash_pipeline.cli import app

if __name__ == "__main__":
    app()
